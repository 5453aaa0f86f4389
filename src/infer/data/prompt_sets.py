"""Shipped prompt sets of the kinds users send an instruct model, for the generation benchmark.

Three kinds, each a user message the chat template wraps, written for infer (not drawn from any
dataset) so every machine times the very same text:

* ``chat``: open-ended questions whose answers the prompt does not contain: model-free drafters
  find little to copy, so these show what speculation costs where it cannot pay.
* ``summary``: a passage to summarise: the answer reuses the passage's phrases.
* ``code-edit``: a function and a small change to make: the answer copies most of the function.
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

PROMPT_SETS: dict[str, tuple[str, ...]] = {"chat": CHAT, "summary": SUMMARY, "code-edit": CODE_EDIT}


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
