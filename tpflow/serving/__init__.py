"""A reward over HTTP: ``tpflow serve-reward`` serves any registered reward, and the ``remote`` reward calls it.

- ``tpflow.serving.client``: the ``remote`` reward, and the wire format both sides speak;
- ``tpflow.serving.server``: the server, its requests handled under ``Limits`` (hostile clients assumed);
- ``tpflow.serving.slots``: the server's connection slots;
- ``tpflow.serving.lifecycle``: the command's life cycle, from its options to a stop by signal.

Serving is its own package because it is a way of running a reward, not a reward: the reward models stay in
``tpflow.rewards``. The ``remote`` reward registers when the registry loads its built-in rewards
(``tpflow.registry``), like any reward in ``tpflow.rewards``. This package imports none of its modules, so that
importing the client does not load the server.
"""
