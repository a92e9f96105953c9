"""The run layer: what every workload's run needs, below the workloads and above the engine.

The run session (cluster, placement, worker groups, context switcher, run directory, logger,
checkpoints tagged with their workload, timings), seeding, checkpoint I/O, the logger and the
timeline plot, and the learner loop. Imports ``pipelines`` only, never a workload.
"""
