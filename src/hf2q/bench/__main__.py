"""`python -m hf2q.bench ...`: the model benchmark, as `hf2q bench` (the kernel sweeps are hf2q.bench.<op>)."""
from hf2q.bench import main

raise SystemExit(main())
