"""tpflow: TurningPoint-GRPO and its baselines for flow-matching text-to-image models.

Public entry point: ``tpflow.build(kind, name, **options)`` builds any registered component.
"""

from tpflow.registry import KINDS, build, register

__all__ = ["KINDS", "build", "register", "__version__"]
__version__ = "0.1.0"
