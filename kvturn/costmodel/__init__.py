"""One cost model for the router's path choice and the planner's simulation: the fits (fits.py), the token
estimator (tokens.py), what a worker's report says (reports.py), the model learned from them (model.py) and the
price of each path with the pure choice among them (paths.py)."""
from kvturn.costmodel.model import COMPUTE_ON_DECODE, PATHS, PULL, RECOMPUTE, CostModel
from kvturn.costmodel.paths import POLICIES, Estimate, PathChoice, TurnView, choose, predict

__all__ = ["COMPUTE_ON_DECODE", "PATHS", "POLICIES", "PULL", "RECOMPUTE", "CostModel", "Estimate", "PathChoice",
           "TurnView", "choose", "predict"]
