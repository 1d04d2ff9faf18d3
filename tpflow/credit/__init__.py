"""Credit assigners (one per file). Importing this package registers them."""

from tpflow.credit.branch import BranchCredit
from tpflow.credit.consistent import ConsistentCredit
from tpflow.credit.incremental import IncrementalCredit
from tpflow.credit.outcome import OutcomeCredit
from tpflow.credit.turning_point import TurningPointCredit

__all__ = ["BranchCredit", "ConsistentCredit", "IncrementalCredit", "OutcomeCredit", "TurningPointCredit"]
