"""m2flow: embodied RL with simulators in the loop, macro workflow -> micro execution flow."""

__version__ = "0.1.0"
