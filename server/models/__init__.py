"""Models and inputs: the registry of served models, model resolution and options, tokenization, media,
the one compute path and its dedup / result cache."""
