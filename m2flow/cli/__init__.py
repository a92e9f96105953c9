"""The commands: one module each over one common module.

    m2flow-train   m2flow.cli.train      m2flow-plan    m2flow.cli.plan
    m2flow-eval    m2flow.cli.eval       m2flow-demos   m2flow.cli.demos
    m2flow-train -m  m2flow.cli.sweep    m2flow-plot    m2flow.cli.plot

Below them: :mod:`m2flow.cli.common` (exit codes, config loading and its one-line errors,
interrupt handling, the end line), :mod:`m2flow.cli.planning` (plan making, ``cluster.plan``),
:mod:`m2flow.cli.workloads` (the one table of workloads; the only module that knows both).
"""
