"""Training (the optional extra ``infer[train]``): pretraining small models, a real target's teacher
cache (its distributions over its own answers to varied prompts), distilling drafts, Medusa heads,
and the cached reference pair."""
