"""Demonstrations for behaviour cloning and RLPD (the command is ``m2flow-demos``,
:mod:`m2flow.cli.demos`): :mod:`.maniskill` records ManiSkill's motion-planning solutions
through m2flow's own env, with the motion planner of :mod:`.screw_planner`."""
