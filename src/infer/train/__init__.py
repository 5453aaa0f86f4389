"""Training (the optional extra ``infer[train]``): pretraining small models, distilling drafts, Medusa
heads and the reference pair."""
