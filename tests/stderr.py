"""Reading what a run printed on stderr, less what the host says about itself."""


def host_warning(line: str) -> bool:
    """The raylet's own warning that the machine's disk is over 95 % full
    (``file_system_monitor.cc``). It is about the host, not the run: on a machine with a nearly
    full disk Ray prints it every ten seconds, between any two lines of the run."""
    return line.startswith("(raylet)") and "file_system_monitor" in line


def run_lines(text: str) -> list[str]:
    """The non-empty lines of ``text``, less the host's warnings."""
    return [line for line in text.splitlines() if line.strip() and not host_warning(line)]
