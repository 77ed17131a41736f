"""``fedray tune``: Ray Tune sweeps over any config key. Specs (:mod:`.spec`), validated before anything starts;
the dry run's plan and the best trial's table (:mod:`.command`); the runner (:mod:`.runner`), whose trials are
simulations; the sweep's own report (:mod:`.report`). It sits above the simulation and, with the runtime, is the
only part of fedray that imports ray."""
