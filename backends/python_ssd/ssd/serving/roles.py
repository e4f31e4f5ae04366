"""Picks the serving class for a model from its config's `role` parameter (an engine model's
parameters are checked here, ssd/config.py's EngineConfig, before anything loads).

Process set-up (threads, core pinning) happens here, before torch spins up its thread pool, so
each engine really runs on its own "device" (one core each by default on CPU). The model classes
are imported only after it, and only the one the role needs; they import nothing from here.
"""
from __future__ import annotations

import json
import os


def model_parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def pin_process(threads: int, cores: str) -> None:
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if cores:
        from .placement import parse_cores  # os only: nothing heavy before the thread set-up
        usable = parse_cores(cores) & os.sched_getaffinity(0)
        if usable:  # silently keep the default on machines with fewer cores
            os.sched_setaffinity(0, usable)


def instance_device(params: dict[str, str], args: dict) -> str:
    """The torch device of this instance: a KIND_GPU instance with device "cuda" runs on the GPU
    Triton placed it on (one instance per GPU listed in instance_group); anything else as given."""
    device = params.get("device", "")
    if device == "cuda" and args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args['model_instance_device_id'])}"
    return device


def create_model(args: dict):
    config = json.loads(args["model_config"])
    params = model_parameters(config)
    name = config.get("name", "")
    if params.get("device"):
        params["device"] = instance_device(params, args)
    role = params.get("role", "")
    if role == "orchestrator":
        from .orchestrator_model import OrchestratorModel
        return OrchestratorModel(config, params)
    from ..config import ROLES, EngineConfig  # dataclasses only: nothing heavy before the thread set-up
    if role not in ROLES:
        raise ValueError(f"model '{name}': parameter 'role' must be orchestrator, {', '.join(ROLES)}, got {role!r}")
    cfg = EngineConfig.from_parameters(params, name)  # refuses an unknown name or a bad value
    # An engine that may compute on the wide cores starts on them: OpenMP counts the CPUs it may use
    # once, at start, and with more threads than that it sleeps at every barrier (a 2-thread forward
    # took 105 ms instead of 85); serving/placement.py then keeps split rounds on the own cores.
    pin_process(cfg.threads, ",".join(filter(None, (cfg.cores, cfg.wide_cores))))
    from .engine_model import EngineModel
    return EngineModel(config, cfg)
