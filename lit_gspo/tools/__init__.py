"""The command-line tools built on the core and the adapter: ``lit-gspo`` (main.py, each subcommand imported only when
it runs), ``eval``, ``compare`` (+ its report), ``ablate`` (+ its report). Tools may import ``lit_gspo.lightning``;
nothing outside tools/ imports them."""
