"""The optimised state: the student's params, the optimizer state and the step.

The teacher is *not* here: it is frozen, never donated, never checkpointed every step.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    step: jax.Array          # int32 scalar: optimizer updates done
    params: Any              # the student's parameter tree
    opt_state: Any
