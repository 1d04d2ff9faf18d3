"""Gradient probes: how well a credit method's update estimates the gradient it should follow (issue 34).

So far the measurement's core: the gradient an arm's optimizer really takes at its first step
(``tpflow.probe.gradient``), the leave-one-out REINFORCE advantages of the reference gradient
(``tpflow.probe.reference``), one paired draw of an arm given as recipe overrides (``tpflow.probe.arms``), and a
fixed random projection that keeps such gradients small enough to store (``tpflow.probe.projection``). The
``tpflow probe`` command, its repeats and its figures are to build on them.
"""
