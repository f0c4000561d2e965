"""Models and inputs: the registry of served models and what one is made of, model resolution and
options, a request's options parsed once, tokenization, media, the one compute path and its dedup /
result cache, and output post-processing."""
