"""The grader. Importing this package (and schema, tables, deck, hardware, roofline, scoring,
submission, schedule) never imports torch: only the worker process and its helpers
(worker, correctness, timing) do, so the site and the CLI stay light."""
