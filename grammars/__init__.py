# Makes the installed copy of this folder the regular package napkin.grammars,
# so importlib.resources.files() returns a plain path (see napkin/resources.py).
