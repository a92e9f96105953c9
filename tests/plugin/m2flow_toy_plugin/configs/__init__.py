"""Config groups this plugin adds to m2flow's (entry point group ``m2flow.configs``)."""
