"""Release evaluation: suites of held-out conditions (perturbed tools, cut budgets), pass^k, exploit probes,
cost, and gates (`jaxagent eval --suite NAME [--gate FILE]`). `suite` holds the YAML types, `runner` runs them."""
