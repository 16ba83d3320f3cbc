"""Inference: forward-only plans placed by speed, pipelined generation with a KV cache per stage, batch
inference and a server.

- :mod:`.cost`: what a stage costs (weights in the serving dtype, KV cache, activations; prefill and decode).
- :mod:`.place`: the speed-aware placement (a DP over devices and block ranges).
- :mod:`.plan`: the versioned JSON plan (``kind: "inference"``).
"""

from .cost import DecoderShape, Objective, Workload
from .place import place, score
from .plan import InferencePlan, InferenceStage, Prediction, load_inference_plan, save_inference_plan

__all__ = ["DecoderShape", "Objective", "Workload", "place", "score", "InferencePlan", "InferenceStage",
           "Prediction", "load_inference_plan", "save_inference_plan"]
