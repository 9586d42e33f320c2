"""The operators: the call path and registry, each family's rules, planners and launches."""
