"""``python -m tpflow``: the CLI (also what ``accelerate launch -m tpflow ...`` runs in each process)."""

from tpflow.cli import main

main()
