"""What the pass tells its user: the report and its table (`report`), the picture
of the program around the sites (`picture`), drawn without Graphviz (`plot`) and
written to a file (`save`)."""
