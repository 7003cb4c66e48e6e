"""Scripts around the package that are not launchers: set-up, fault injection, GPU checks, studies (scripts/README.md)."""
