"""Observability: metrics with explicit reductions, stage timers, memory, MFU, loggers and plots."""

from rlloom.observability.log import init_logger
from rlloom.observability.logger import Logger, MultiLogger
from rlloom.observability.loggers import build_loggers
from rlloom.observability.metrics import Max, Mean, Metric, MetricsAccumulator, Min, Sum, reduce_across_ranks
from rlloom.observability.timers import StageTimer

__all__ = [
    "Logger",
    "Max",
    "Mean",
    "Metric",
    "MetricsAccumulator",
    "Min",
    "MultiLogger",
    "StageTimer",
    "Sum",
    "build_loggers",
    "init_logger",
    "reduce_across_ranks",
]
