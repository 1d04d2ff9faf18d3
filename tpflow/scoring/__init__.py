"""Calling rewards: the engine's way of calling a reward model, as ``tpflow.rollout`` is its way of calling the
backbone.

The reward models themselves live in ``tpflow.rewards`` (one per file); this package holds what every caller of a
reward shares (training rollouts, the trainer's evaluation, ``tpflow eval``, ``inspect-trajectory``):

- ``tpflow.scoring.call``: ``call_reward``, every reward call, with output checks, retries and a time limit;
- ``tpflow.scoring.groups``: prompt groups as a reward sees them, and the check that a group-relative reward's calls
  hold whole groups;
- ``tpflow.scoring.watched``: ``[eval] rewards``, rewards the evaluation watches but the run does not train on;
- ``tpflow.scoring.diversity``: ``[eval] diversity``, how different a prompt's images are from each other.

It imports nothing from its submodules, so that a reward (``tpflow.rewards.pairwise``) can import one of them
without loading the others. These modules import only the foundations (docs/architecture.md, "Layers"): the rewards
that call other rewards (``weighted``, ``frames``, ``pairwise``) check their parts' outputs through them.
"""
