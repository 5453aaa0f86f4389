"""Speculative decoding as a library: the drafter contract and the drafters (a draft model, n-gram
prompt lookup, Medusa heads, suffix decoding), the budget controller that sizes each round's chain or
tree, the grammar's filter between a proposal and the one verified, and lossless verification of
chains and trees behind one entry point (``verification.verify``)."""
