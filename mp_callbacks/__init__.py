"""mp_callbacks: one mixed-precision core for Lightning and Keras.

The core imports no deep-learning framework: the scaler transition is written
over a small array-ops protocol (:mod:`mp_callbacks.ops`), evaluated here with
NumPy float32 and by the adapters with torch tensors or ``keras.ops``.
"""

from .diagnostics.divergence import DivergenceError, DivergenceRule
from .diagnostics.metrics import METRICS, History, StepStats
from .loss_scale.config import PRESETS, ScalerConfig
from .loss_scale.scaler import DynamicLossScaler, ScaleFloorError, ScaleFloorWarning
from .loss_scale.transition import ScalerState, checks_overflow, initial_state, next_state
from .memory.estimate import MemoryEstimate, bytes_per_param, estimate_memory
from .ops import NUMPY_OPS, ArrayOps, NumpyOps
from .policy import PolicyError, PrecisionPolicy
from .recipes import RECIPE_NAMES, Recipe, RecipeError, canonical_recipe_name, get_recipe
from .settings import ConfigError, StateDictError
from .weights import MasterPlan

__version__ = "0.1.0"

__all__ = [
    "ArrayOps", "ConfigError", "DivergenceError", "DivergenceRule", "DynamicLossScaler", "History", "METRICS",
    "MasterPlan",
    "MemoryEstimate", "NUMPY_OPS", "NumpyOps", "PRESETS", "PolicyError", "PrecisionPolicy",
    "RECIPE_NAMES", "Recipe", "RecipeError", "ScaleFloorError", "ScaleFloorWarning",
    "ScalerConfig", "ScalerState", "StateDictError", "StepStats", "bytes_per_param",
    "canonical_recipe_name", "checks_overflow", "estimate_memory", "get_recipe", "initial_state", "next_state",
]
