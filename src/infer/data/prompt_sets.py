"""Shipped prompt sets of the kinds users send an instruct model, for the generation benchmark.

Each kind is a user message the chat template wraps, written for infer (not drawn from any dataset)
so every machine times the very same text:

* ``chat``: open-ended questions whose answers the prompt does not contain: model-free drafters
  find little to copy, so these show what speculation costs where it cannot pay.
* ``summary``: a passage to summarise: the answer reuses the passage's phrases.
* ``code-edit``: a function and a small change to make: the answer copies most of the function.
* ``qa``: short factual questions: a sentence of an answer, nothing in the prompt to copy.
* ``math``: word problems to work step by step (their worked answers are ``MATH_WORKED``): the
  working repeats the problem's numbers and its own intermediate results.
* ``translation``: a short English passage into French, Spanish or German: names and numbers copy.
* ``rag``: a question to answer from a given document, quoting it: the answer copies sentences.
* ``extract-json``: facts from a message as a JSON object of named keys, asked for in words (no
  grammar: the structured-output benchmark sends ``SCHEMA_EXTRACTION`` with one): keys and values
  copy from the prompt.

``DEMO_KINDS`` are the three ``infer demo`` (and the llama-server comparison) run by default.
"""

from __future__ import annotations

from typing import Any

CHAT = (
    "What are some good habits for staying focused while working from home?",
    "Explain to a ten-year-old why the sky is blue.",
    "I am planning a three-day trip to a city I have never visited. How should I plan it?",
    "What is the difference between a virus and a bacterium?",
    "Give me some ideas for a healthy breakfast that takes less than ten minutes to make.",
    "Why do people enjoy listening to sad music?",
    "How can I get better at public speaking?",
    "What should I consider before adopting a dog?",
)

_PASSAGES = (
    """The city council met on Tuesday evening to discuss the future of the old railway station. The \
building, which has stood empty since the last train left in 1998, is owned by the city and costs \
about forty thousand dollars a year to keep safe. Three proposals were presented. The first would turn \
the station into a public library with a small cafe. The second, from a private developer, would \
convert it into apartments and shops, bringing in tax revenue but closing the main hall to the public. \
The third would demolish the building and build a park. Many residents spoke in favour of the library, \
saying the town has no space for young people to study in the evening. The developer argued that only \
his plan pays for itself. The council will vote next month after a public survey.""",
    """Honeybees communicate the location of food through a behaviour known as the waggle dance. When a \
forager returns to the hive after finding a good patch of flowers, she moves in a figure-eight pattern \
on the vertical surface of the honeycomb. During the straight middle part of the dance she waggles her \
body from side to side. The angle of this straight run relative to the vertical tells the other bees \
the direction of the food relative to the sun. The length of the waggle run tells them the distance: \
the longer the run, the farther away the flowers are. Other bees follow the dancer closely, touching \
her with their antennae, and then fly out to find the food themselves. The dance was first decoded by \
the Austrian scientist Karl von Frisch, who received a Nobel Prize for his work in 1973.""",
    """Our quarterly results show steady growth despite a difficult market. Revenue rose eight percent \
compared with the same quarter last year, driven mainly by the new subscription plan, which now has \
more than two hundred thousand customers. Hardware sales fell by twelve percent as customers delayed \
upgrades, and we expect this trend to continue until the next product launch in the spring. Operating \
costs grew faster than revenue because we hired sixty engineers for the cloud team and opened a second \
support centre. As a result, profit was flat. For the rest of the year we will focus on keeping \
subscription customers, reducing the time it takes to answer support requests, and lowering the cost \
of our data centres by moving older services to newer machines.""",
    """Sleep plays an important role in how the brain stores memories. During the day, new experiences \
are recorded quickly in a region called the hippocampus, but this storage is temporary and easily \
disturbed. During deep sleep, the hippocampus replays the day's experiences, and the patterns are \
gradually transferred to the cortex, where they can last for years. Studies have shown that people who \
sleep after learning a list of words remember more of them the next day than people who stay awake for \
the same amount of time. Dreaming sleep seems to help with different kinds of learning, such as skills \
and emotional memories. Because of this, scientists advise students to sleep well before and after an \
exam rather than studying through the night.""",
    """The library will change its opening hours from the first of next month. On weekdays it will open \
at nine in the morning instead of ten and close at eight in the evening instead of seven. On Saturdays \
the hours stay the same, from ten to four, and the library will remain closed on Sundays. The change \
follows a survey in which most visitors asked for earlier opening so they can visit before work. To pay \
for the longer hours, the library will close its second-floor reading room on Friday afternoons. Books \
can still be returned at any time through the drop box by the main entrance, and the online catalogue \
and e-book service are not affected. Questions can be sent to the front desk by email or phone.""",
    """Composting turns kitchen and garden waste into a rich material that improves soil. A good compost \
pile needs a balance of green materials, such as vegetable scraps, coffee grounds and fresh grass \
cuttings, and brown materials, such as dry leaves, straw and cardboard. The greens provide nitrogen and \
the browns provide carbon. The pile should be kept about as damp as a squeezed sponge and turned every \
week or two so that air reaches the middle, where bacteria do most of the work. Meat, dairy and oily \
food should be left out because they smell and attract animals. Depending on the weather and how often \
the pile is turned, the compost is ready in two to six months, when it is dark, crumbly and smells like \
earth.""",
)

SUMMARY = tuple(f"Summarize the following passage in a few sentences.\n\n{p}" for p in _PASSAGES)

_EDITS = (
    ("Rename the function to `mean_of` and the variable `total` to `acc`. Reply with the whole function.",
     """def average(values):
    if not values:
        raise ValueError("average of an empty list")
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""),
    ("Add a docstring to this function and type hints to its arguments. Reply with the whole function.",
     """def clamp(value, low, high):
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value
"""),
    ("Change this function so that it skips blank lines. Reply with the whole function.",
     """def read_words(path):
    words = []
    with open(path) as f:
        for line in f:
            for word in line.split():
                words.append(word.lower())
    return words
"""),
    ("Make the retry count a keyword argument `retries` with default 3. Reply with the whole function.",
     """import time


def fetch(client, url):
    for attempt in range(3):
        try:
            return client.get(url)
        except ConnectionError:
            time.sleep(2 ** attempt)
    raise RuntimeError(f"could not fetch {url}")
"""),
    ("Replace the print calls with calls to a module-level logger. Reply with the whole code.",
     """def process(items):
    print("processing", len(items), "items")
    done = 0
    for item in items:
        if item.is_valid():
            item.save()
            done += 1
        else:
            print("skipping invalid item", item.id)
    print("processed", done, "items")
    return done
"""),
    ("Add a method `area` that returns the rectangle's area. Reply with the whole class.",
     """class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def perimeter(self):
        return 2 * (self.width + self.height)

    def scale(self, factor):
        return Rectangle(self.width * factor, self.height * factor)
"""),
)

CODE_EDIT = tuple(f"{task}\n\n```python\n{code}```" for task, code in _EDITS)

QA = tuple(f"{q} Answer in one sentence." for q in (
    "What is the capital city of Australia?",
    "Who wrote the novel Pride and Prejudice?",
    "How many legs does a spider have?",
    "At what temperature in degrees Celsius does water boil at sea level?",
    "Which planet is closest to the Sun?",
    "How many continents are there on Earth?",
    "In which year did the Second World War end?",
    "How many minutes are there in one day?",
))

# (problem, worked answer, final answer): the prompts are the problems; the worked answers are ours,
# checked by the tests (each step's arithmetic holds).
MATH_WORKED: tuple[tuple[str, str, str], ...] = (
    ("A bakery sells muffins for $3 each and cookies for $2 each. On Monday it sold 45 muffins and 60 cookies. "
     "How much money did it take in on Monday?",
     "Muffins: 45 * 3 = 135 dollars.\nCookies: 60 * 2 = 120 dollars.\nTotal: 135 + 120 = 255 dollars.", "255"),
    ("Priya has 120 stickers. She gives a quarter of them to her brother and then 18 to her friend. How many "
     "stickers does she have left?",
     "A quarter of 120: 120 / 4 = 30.\nAfter her brother: 120 - 30 = 90.\nAfter her friend: 90 - 18 = 72.", "72"),
    ("A rectangular garden is 14 metres long and 9 metres wide. A path 1 metre wide runs all the way around the "
     "outside of it. What is the area of the path in square metres?",
     "With the path: (14 + 2) * (9 + 2) = 16 * 11 = 176.\nThe garden alone: 14 * 9 = 126.\nThe path: 176 - 126 = 50.",
     "50"),
    ("A shop takes 25% off a jacket priced at $80, and then another $10 off at the till. What is the final "
     "price?",
     "25% of 80: 80 * 25 / 100 = 20.\nAfter the discount: 80 - 20 = 60.\nAt the till: 60 - 10 = 50 dollars.", "50"),
    ("Three friends share a taxi fare of $42 and a tip of $6 equally. How much does each of them pay?",
     "Fare and tip: 42 + 6 = 48 dollars.\nEach pays: 48 / 3 = 16 dollars.", "16"),
    ("A cyclist rides at 18 km per hour for 2.5 hours, then at 12 km per hour for 1.5 hours. How far does she "
     "ride in total?",
     "First part: 18 * 2.5 = 45 km.\nSecond part: 12 * 1.5 = 18 km.\nTotal: 45 + 18 = 63 km.", "63"),
    ("A school orders 7 boxes of pencils with 24 pencils in each box. It gives 5 pencils to each of its 30 "
     "students. How many pencils are left over?",
     "Pencils ordered: 7 * 24 = 168.\nPencils given out: 5 * 30 = 150.\nLeft over: 168 - 150 = 18.", "18"),
    ("A water tank holds 600 litres. A pipe fills it at 15 litres per minute while a tap drains 5 litres per "
     "minute. Starting empty, how many minutes does the tank take to fill?",
     "Net filling rate: 15 - 5 = 10 litres per minute.\nTime to fill: 600 / 10 = 60 minutes.", "60"),
)

MATH = tuple(f"Solve this problem. Show your working step by step, then give the final answer on its own line "
             f"as 'Answer: <number>'.\n\n{problem}" for problem, _, _ in MATH_WORKED)

_TRANSLATIONS = (
    ("French", "The museum opens at ten o'clock every morning except Monday. Tickets cost twelve euros for adults "
               "and are free for children under twelve. The guided tour starts at the main entrance at two in the "
               "afternoon."),
    ("Spanish", "Dear Ms. Ortega, thank you for your letter of 3 March. I am happy to confirm your reservation for "
                "two nights, from Friday 14 to Sunday 16 June, in a double room with a view of the harbour. "
                "Breakfast is included."),
    ("German", "Please switch off the lights and close all the windows when you leave the office. The last person "
               "to leave should also lock the front door and put the key in the box next to reception."),
    ("French", "My sister lives in a small village near the mountains. Every summer we visit her for two weeks. "
               "We walk in the forest in the morning, and in the evening we eat dinner outside with her "
               "neighbours."),
    ("Spanish", "From Monday, bus line 14 will run every fifteen minutes between the central station and the "
                "university. The first bus leaves at six in the morning and the last one at eleven at night."),
    ("German", "Step 1: Remove the old filter from the coffee maker. Step 2: Rinse the water tank with warm water. "
               "Step 3: Insert the new filter and fill the tank up to the line marked MAX."),
    ("French", "Our weekly meeting has moved from Tuesday to Thursday, still at half past nine. Please bring the "
               "sales figures for April and your ideas for the summer campaign."),
    ("Spanish", "The pancakes need three eggs, two hundred grams of flour, a glass of milk and a pinch of salt. Mix "
                "everything in a large bowl, let it rest for ten minutes, and cook them in a hot pan."),
)

TRANSLATION = tuple(f"Translate the following text into {language}. Reply with the translation only.\n\n{text}"
                    for language, text in _TRANSLATIONS)

_DOCUMENTS = (
    ("""Nimbus API rate limits. Every API key may send a limited number of requests per minute: 60 on the free \
plan, 600 on the team plan and 3,000 on the enterprise plan. Each response carries the headers \
X-RateLimit-Remaining, the requests left in the current minute, and X-RateLimit-Reset, the seconds until \
the count starts again. A request over the limit is answered with status 429 and a Retry-After header. On \
the free plan a client must wait at least 30 seconds after a 429 before trying again; on paid plans the \
Retry-After value is the only rule. Keys that keep sending requests while limited are suspended for one \
hour. Batch endpoints count as one request per item in the batch.""",
     "How long must a client on the free plan wait after a 429 response?"),
    ("""Travel expenses. Employees travelling for work may claim economy train or air fares booked through the \
travel desk. Hotel costs are covered up to 150 euros a night in most cities and up to 220 euros a night in \
London, Paris and Zurich. Meals are paid as a daily allowance of 45 euros, so receipts for food are not \
needed. Taxis are covered only between 10 pm and 6 am, or when no public transport runs to the destination; \
in every other case employees should take the train or bus. Claims must be submitted within 30 days of the \
end of the trip, with the booking confirmations attached.""",
     "Can an employee claim a taxi from the airport at 11 pm?"),
    ("""Warranty. Your kettle is guaranteed for two years from the date of purchase against faults in materials \
and workmanship. If it develops such a fault, we will repair or replace it free of charge. The warranty does \
not cover damage caused by dropping the kettle, by using it with a power supply other than the one on the \
label, or by limescale left to build up; we recommend descaling it once a month in hard water areas. To make \
a claim, return the kettle to the shop where you bought it together with the receipt. Replacement parts are \
guaranteed for the rest of the original two years.""",
     "Is a kettle that stopped working after it was dropped covered by the warranty?"),
    ("""tidyfile 2.4 release notes. New: the --jobs option runs the cleanup on several folders at once. New: a \
summary of the space freed is printed at the end of every run. Changed: --fast has been replaced by \
--level quick, and --level thorough is now the default. Changed: hidden files are skipped unless \
--include-hidden is given. Fixed: symbolic links to folders are no longer followed, so a link can no longer \
make tidyfile clean a folder twice. Removed: the --legacy-names option, deprecated since version 2.1.""",
     "Which option replaces --fast in tidyfile 2.4?"),
    ("""Pool rules. The pool is open from 7 am to 9 pm, and the deep end closes at 8 pm. Children under 8 must be \
accompanied in the water by an adult at all times. Children aged 8 to 13 may swim without an adult once they \
have passed the pool's 25-metre swimming test; until then an adult must stay on the poolside. Showers must be \
taken before entering the water. Glass bottles and food are not allowed on the poolside. Lane swimming takes \
place every weekday from 7 to 9 am, when the pool is divided into slow, medium and fast lanes.""",
     "May a 10-year-old who has passed the swimming test swim without an adult?"),
    ("""Parking at Riverside Garage. The garage is open 24 hours a day. On weekdays parking costs 2 euros per hour \
for the first three hours and 1.50 euros for every hour after that, up to a maximum of 15 euros a day. On \
Saturdays and Sundays a flat rate of 6 euros covers the whole day. Motorcycles park free of charge in the \
marked bays on level 0. Tickets are paid at the machines by the lifts before returning to your vehicle, by \
card or in cash; the exit barrier does not take payment. A lost ticket is charged at the daily maximum.""",
     "How much does it cost to park for five hours on a Saturday?"),
    ("""Settings files. A settings file is divided into sections, each starting with its name in square brackets, \
such as [display]. Inside a section each line holds one key and its value separated by an equals sign. \
Lines starting with # are comments and are ignored. Keys are not case sensitive, but values are kept exactly \
as written. When the same key appears twice in one section, the later value replaces the earlier one and a \
warning is printed. A key that appears before the first section belongs to the default section, whose values \
apply to every other section that does not set the key itself.""",
     "What happens when the same key appears twice in one section?"),
    ("""Appointments at the Elm Street clinic. Appointments can be booked by phone or at the front desk, from 8 am \
to 6 pm on weekdays. Please arrive ten minutes early. An appointment cancelled less than 24 hours \
in advance is charged a fee of 20 euros, unless the cancellation is due to illness. Patients who are more \
than 15 minutes late may be asked to rebook. Repeat prescriptions are ready two working days after they are \
requested and can be collected from the front desk. For urgent problems outside opening hours, call the \
regional out-of-hours service.""",
     "How far in advance must an appointment be cancelled to avoid the fee?"),
)

RAG = tuple(f"Answer the question using only the document below. Quote the sentence of the document that "
            f"supports your answer.\n\nDocument:\n{document}\n\nQuestion: {question}" for document, question in _DOCUMENTS)

_EXTRACTIONS = (
    (("passenger", "flight", "from", "to", "date", "seat"),
     "Booking confirmed for Mr. Daniel Reyes on flight LX 1423 from Geneva to Lisbon, departing 21 May 2027 at "
     "07:15. Seat 14C has been reserved. Please be at the gate 30 minutes before departure."),
    (("title", "company", "location", "salary", "remote"),
     "Greenfield Analytics is hiring a Data Engineer for its office in Leeds. The role pays 52,000 pounds a year "
     "and can be done fully remotely, with a visit to the office once a month."),
    (("address", "rooms", "rent", "available_from", "pets_allowed"),
     "Bright flat at 27 Harbour Lane, two bedrooms plus a living room (3 rooms in all). Rent is 1,150 a month, "
     "bills not included. Free from 1 September. Sorry, no pets."),
    (("invoice_number", "customer", "amount", "currency", "due_date"),
     "Invoice INV-2027-0388 to Blue Fern Studio for website maintenance in March: 2,340.00 EUR, payable by "
     "15 April 2027 to the account shown below."),
    (("component", "version", "severity", "expected", "actual"),
     "Bug in the export dialog of version 3.2.1: choosing CSV saves the file as XLSX instead. I expected a .csv "
     "file. This blocks our monthly report, so I would call it high severity."),
    (("dish", "servings", "prep_minutes", "ingredients"),
     "Lentil soup for four people. Takes about 40 minutes to prepare. You need red lentils, one onion, two "
     "carrots, a tin of tomatoes, vegetable stock and a teaspoon of cumin."),
    (("date", "attendees", "decisions", "next_meeting"),
     "Notes from 9 March: Aisha, Ben and Chloe attended. We agreed to move the launch to June and to hire one "
     "more designer. The next meeting is on 23 March."),
    (("product", "rating", "pros", "cons", "would_recommend"),
     "I gave the Brightline R5 robot vacuum 4 stars out of 5. It is quiet and the battery lasts a long time, but "
     "it gets stuck under the sofa and the app is slow. Still, I would buy it again."),
)

EXTRACT_JSON = tuple(
    "Extract the following details from the text as a JSON object with the keys "
    + ", ".join(f'"{key}"' for key in keys) + ". Use a list where there are several values and null where the "
    f"text does not say. Reply with the JSON object only.\n\n{text}" for keys, text in _EXTRACTIONS)

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "chat": CHAT, "summary": SUMMARY, "code-edit": CODE_EDIT, "qa": QA, "math": MATH, "translation": TRANSLATION,
    "rag": RAG, "extract-json": EXTRACT_JSON}
# The kinds `infer demo` and `infer bench serving --peer` run by default (the demo's time and the peer
# table stay as they were when more kinds shipped).
DEMO_KINDS = ("chat", "summary", "code-edit")


# Structured output (issue 52): extractions into a JSON Schema of several keys, and forced tool calls.
# Not a PROMPT_SETS kind (those are sent without a grammar); the grammar-drafting benchmark
# (scripts/grammar_drafting_bench.py) sends these through `infer serve` with response_format or tools.
_CONTACT: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string"}, "job": {"type": "string"}, "employer": {"type": "string"},
    "city": {"type": "string"}, "email": {"type": "string"}, "phone": {"type": "string"}},
    "required": ["name", "job", "employer", "city", "email", "phone"], "additionalProperties": False}
_ORDER: dict[str, Any] = {"type": "object", "properties": {
    "customer": {"type": "string"}, "item": {"type": "string"}, "quantity": {"type": "integer"},
    "unit_price": {"type": "number"}, "express_shipping": {"type": "boolean"},
    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}},
    "required": ["customer", "item", "quantity", "unit_price", "express_shipping", "status"],
    "additionalProperties": False}
_EVENT: dict[str, Any] = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string"}, "start_time": {"type": "string"},
    "location": {"type": "string"}, "expected_attendees": {"type": "integer"},
    "category": {"enum": ["conference", "workshop", "meetup", "concert", "sports"]}},
    "required": ["title", "date", "start_time", "location", "expected_attendees", "category"],
    "additionalProperties": False}
_BOOK: dict[str, Any] = {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
    "genre": {"enum": ["fiction", "mystery", "science", "history", "biography", "fantasy"]},
    "pages": {"type": "integer"}, "in_stock": {"type": "boolean"}},
    "required": ["title", "author", "year", "genre", "pages", "in_stock"], "additionalProperties": False}

SCHEMA_EXTRACTION: tuple[tuple[str, dict[str, Any]], ...] = (
    ("Extract the contact details from this message as JSON.\n\nHi, I'm Maria Gonzalez, a nurse at St. Mary's "
     "Hospital in Denver. You can reach me at maria.gonzalez@example.com or on 555-0142.", _CONTACT),
    ("Extract the contact details from this signature as JSON.\n\nBest regards,\nTom Becker\nSenior Software "
     "Engineer, Northwind Labs\nBerlin, Germany\ntom.becker@northwind.example | +49 30 1234567", _CONTACT),
    ("Extract the order from this email as JSON.\n\nHello, this is James Lee. I ordered three blue ceramic mugs "
     "at 12.50 each with express shipping, and the tracking page says they have been shipped.", _ORDER),
    ("Extract the order from this note as JSON.\n\nCustomer Anna Schmidt wants 2 standing desks at 349.99 "
     "each. Regular shipping is fine. The order has not been sent yet.", _ORDER),
    ("Extract the event from this announcement as JSON.\n\nJoin us for PyData Lisbon on March 14, 2027 at "
     "9:30 AM in the Lisbon Congress Centre. About 400 data scientists are expected for two days of talks.",
     _EVENT),
    ("Extract the event from this flyer as JSON.\n\nThe Riverside Jazz Night is back! Saturday, June 5, "
     "starting at 7 PM at Riverside Park Amphitheater. We expect around 1,200 music lovers.", _EVENT),
    ("Extract the book's details from this listing as JSON.\n\n'The Silent Harbor' by Elena Marsh (2019), a "
     "mystery novel of 352 pages. Currently available in our store.", _BOOK),
    ("Extract the book's details from this review as JSON.\n\nIn 'A Short History of Light' (2021), physicist "
     "Daniel Okafor traces how we came to understand light over 288 pages. Sadly, it is sold out here.", _BOOK),
)

_WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "country", "unit"],
        "additionalProperties": False}}}
_BOOKING: dict[str, Any] = {"type": "function", "function": {
    "name": "book_table", "description": "Reserve a table at a restaurant",
    "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string"}, "date": {"type": "string"}, "time": {"type": "string"},
        "party_size": {"type": "integer"}, "outdoor": {"type": "boolean"}},
        "required": ["restaurant", "date", "time", "party_size", "outdoor"], "additionalProperties": False}}}
_EMAIL: dict[str, Any] = {"type": "function", "function": {
    "name": "send_email", "description": "Send an email",
    "parameters": {"type": "object", "properties": {
        "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"},
        "priority": {"enum": ["low", "normal", "high"]}}, "required": ["to", "subject", "body", "priority"],
        "additionalProperties": False}}}
_TOOLS: list[dict[str, Any]] = [_WEATHER, _BOOKING, _EMAIL]

# (user message, tools, the function tool_choice forces)
TOOL_CALLS: tuple[tuple[str, list[dict[str, Any]], str], ...] = (
    ("What's the weather like in Lyon, France right now? I prefer Celsius.", _TOOLS, "get_weather"),
    ("Is it hot in Phoenix, USA today? Give me Fahrenheit.", _TOOLS, "get_weather"),
    ("Book a table for four at Luigi's Trattoria next Friday, December 11, at 7:30 PM, outside if possible.",
     _TOOLS, "book_table"),
    ("Reserve a table at Sakura Sushi on 2027-01-15 at 12:00 for two people, indoors.", _TOOLS, "book_table"),
    ("Email bob@example.com that the quarterly report is ready for review; it's urgent.", _TOOLS, "send_email"),
    ("Send a low-priority note to team@example.com saying the office will be closed on Monday.", _TOOLS,
     "send_email"),
)
