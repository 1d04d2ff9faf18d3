"""Gradient probes: how well a credit method's update estimates the gradient it should follow (docs/probe.md).

So far the measurement's core: the gradient an arm's optimizer really takes at its first step
(``tpflow.probe.gradient``), the leave-one-out REINFORCE advantages of the reference gradient
(``tpflow.probe.reference``), one paired draw of an arm given as recipe overrides (``tpflow.probe.arms``), and a
fixed random projection that keeps such gradients small enough to store (``tpflow.probe.projection``), and the
figures computed from them (``tpflow.probe.stats``); beside them, Monte Carlo values of the window states that
TP-GRPO's completions stand in for (``tpflow.probe.value``). The ``tpflow probe`` command, its repeats, its
reference batch and its report are to build on them.
"""
