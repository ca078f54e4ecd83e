"""Training parity: does a real training run on a device converge like the reference device, within the reference's
own seed-to-seed spread? ``runs`` trains, ``band`` builds (and caches) the reference band, ``verdict`` judges,
``stats`` holds the one-sided Welch t-test, ``faults`` the planted faults that must fail, ``document`` the report."""
