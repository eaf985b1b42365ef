from difftrain.cli.app import main

main()
