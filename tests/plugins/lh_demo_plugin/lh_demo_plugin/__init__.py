"""A plugin package: importing it must not be needed to list its environment."""

IMPORTED = True
