"""The qax test suite (a package, so every support module has one name: tests.<name>)."""
