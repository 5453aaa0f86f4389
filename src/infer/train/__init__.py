"""Training-side utilities: text corpora and BPE tokenizer training for tiny test/demo models."""
