"""The command line's verbs: each module here is one, named as the verb,
declaring ``VERB = Verb(...)`` (``aioublk.frontend.verb``): its parser and
its handler. A new module is a new verb; nothing else lists them."""
