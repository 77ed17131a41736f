"""``fedray tune``: Ray Tune sweeps over any config key. Specs (:mod:`.spec`), validated before anything starts;
the runner (:mod:`.runner`), whose trials are simulations; the sweep's own report (:mod:`.report`). It sits above
the simulation and, with the runtime, is the only part of fedray that imports ray."""
