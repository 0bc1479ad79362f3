"""Natural Language Autoencoders: an actor explains an activation vector injected at a marker
token's embedding, a critic (the reconstructor) rebuilds the vector from the explanation, and
the actor's reward is how close the rebuilt vector is. Run files in the form of the public
verl NLA fork load as written (see docs/nla.md)."""
