"""Natural Language Autoencoders: an actor explains an activation vector injected at a marker
token's embedding, a critic (the reconstructor) rebuilds the vector from the explanation, and
the actor's reward is how close the rebuilt vector is. Run files in the form of the public
verl NLA fork load as written (see docs/nla.md).

This package sits above `ember.trainer`: its trainers (`rl.py`, `sft.py`) are the RL and SFT loops with
the vector injected, built by `rl_setup.py` from the trainer's parts; nothing in `ember.trainer` imports it."""
