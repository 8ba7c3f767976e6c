"""The four roles (learner, stage, syncer, verifier): thin shells wiring the cores to the network.

`registry` chooses a role for `--role auto` and builds one; each role module exports `create_role(ctx)`.
"""
