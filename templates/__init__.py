# Makes the installed copy of this folder the regular package napkin.templates,
# so importlib.resources.files() returns a plain path (see napkin/resources.py).
