"""`pdserve drill`: fault scenarios against a live cluster under load, and the table that
says whether it recovers (docs/operations.md, "Drills").

Module map (data flows top to bottom):

    cli.py            options; its own `pdserve up` (up_cluster.py) or a running one
    main.py           wiring: layout found, scenarios picked, run, table printed and written
    scenario.py       the scenarios and which a layout allows (pure)
    target_cluster.py the gateway's admin views, the workers' probes and faults
    processes.py      the cluster's processes from /proc; kill, stop, cont
    fault.py          hit the victim; lift what was set
    steady_load.py    bench's planned requests at a steady rate until told to stop
    recovery.py       out of routing? whole again? (pure, over snapshots)
    runner.py         one scenario: load, fault, watch, after, held; then the row
    row.py            the row, its judgement (pure) and the Markdown table
"""
