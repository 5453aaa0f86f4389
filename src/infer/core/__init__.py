"""What the engine and the drafters share: requests, detokenization, running a model over a KV pool."""
