"""The planner: measured profiles -> cost models -> a search over execution plans.

Knows no workload: a workload describes itself as a component graph (:mod:`.graph`) and
measures its components (``m2flow.embodied.profile``, ``m2flow.reasoning.profile``); the
planner fits the profile (:mod:`.costmodel`), corrects it by real iterations of the config's
own plan (:mod:`.calibration`), predicts iteration time and memory of every plan on the node
(:mod:`.space` enumerates them, :mod:`.search` predicts them) and writes the chosen one as a
file of config overrides (:mod:`.planfile`).
"""
