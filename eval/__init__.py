"""The grader. Importing this package (and schema, tables, deck, hardware, roofline, scoring,
submission, schedule, job, worker, phases, failure) never imports torch: only the worker process's
judge and its runner (judge, link, protocol, runner, plan, audit, correctness, timing) do, so the
site and the CLI stay light."""
