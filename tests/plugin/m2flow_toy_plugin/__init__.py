"""A toy simulator plugin for m2flow (see docs/plugins.md)."""
