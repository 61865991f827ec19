"""Process runtime knobs: the cyclic GC (`gcpause`, `gcfreeze`) and the C heap
(`malloctune`). Each exists because a role measured a need for it; each module's
docstring says which, and which script measures it."""
