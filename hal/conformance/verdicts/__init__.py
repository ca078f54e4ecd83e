"""How a result is judged: error metrics against the float64 reference (``metrics``) and the tolerance table
by op category and dtype with the rule that turns errors into a verdict (``tolerances``)."""
