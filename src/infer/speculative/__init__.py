"""Speculative decoding as a library: the drafter contract and the drafters (a draft model, n-gram
prompt lookup, Medusa heads, suffix decoding), the budget controller that sizes each round's chain or
tree, and lossless chain and tree verification (rejection sampling, and its greedy shortcut)."""
