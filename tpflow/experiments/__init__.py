"""Experiments: a pre-registered comparison of recipe arms over seeds (docs/experiments.md).

``spec.py`` reads and validates the experiment file, ``lock.py`` records what was registered before the first run
(and every declared amendment), ``sweep.py`` runs the missing (arm, seed) runs, ``compare.py`` turns the finished
runs into the paired comparison the file names, ``command.py`` is the command line (``tpflow sweep``,
``tpflow compare``; ``tpflow validate`` accepts an experiment file too).
"""
