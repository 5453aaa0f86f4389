"""Text the project finds on every machine: the Python standard library's source as a corpus, the
benchmark and audit prompt sets drawn from it, and the small BPE tokenizer trained on it (the
reference pair's and the test models')."""
