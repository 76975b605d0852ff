"""Test hooks that make a real run fail at a named point (``kill_points``); inert when unset."""
